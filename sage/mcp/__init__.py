"""``astrid mcp serve``: a stdio MCP server that proxies a principal's tools from the bus.

``protocol`` is the sans-IO JSON-RPC core, ``serve`` the async stdio shell.
"""
