"""What test modules share: helpers and fixtures, one module per test module they came from (tests/unit/test_x.py
and its neighbours: tests/helpers/x.py). A test module imports these, never another test module."""
