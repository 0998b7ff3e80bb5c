"""The JSON-RPC socket: protocol framing, method table, peers and the server."""
