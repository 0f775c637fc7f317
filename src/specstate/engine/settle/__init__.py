"""Settlement: the result processor, the output table and the one place a request ends."""
