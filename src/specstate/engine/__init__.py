"""Engine layer: worker protocol, scheduler loops and the result processor."""
