"""The transport-free data plane: admission, filling, layouts, exports and leases (its errors and ledger are the
floors every layer shares: paraminit_server.errors, paraminit_server.ledger)."""
