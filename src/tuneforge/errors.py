"""The one exception type for mistakes a user can fix.

A ``UserError`` is printed as its message alone (no traceback) and exits with status 2.
Internal invariants use ``assert`` instead: those are our bugs, and the traceback helps.
"""


class UserError(Exception):
    """A located, actionable problem with the user's config, data or command line."""
