"""The running test's near-ties, one list for both copies of tests/conftest.py: pytest
imports it as `conftest` (its fixtures, the budget among them) and the test modules as
`tests.conftest` (`compare_greedy`), two modules with globals of their own."""

NOTES: list[str] = []
