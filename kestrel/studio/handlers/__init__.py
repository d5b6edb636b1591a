"""Plain handler functions, one module per tab. Each returns a dict of named outputs (the names
of its tab's components); none keeps per-user data at module level."""
