"""Peer-engine runners. Each is a standalone script run with the peer's own virtualenv python:
`python <script> SPEC.json OUT.json`. They import nothing from pagedcore (it is not installed there)."""
