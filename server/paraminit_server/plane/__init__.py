"""The transport-free data plane: admission, filling, layouts, exports, leases and its errors."""
