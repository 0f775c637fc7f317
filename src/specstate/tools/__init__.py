"""Tools: the ownership linter and the command line."""
