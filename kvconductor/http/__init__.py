"""The HTTP API (contract section 4 and operations): `api` the aiohttp routes and
rules, `front` the fast path that answers plain queries straight off the socket,
`auth` the one bearer-token check, `serve` the API started from an index.
"""
