"""Pure-function model families."""
