"""servex.server.protocols.servex: servex's own services (protos/servex/v1).

``graph_service.py``: GraphExecutor.Run, a run by tensor names with an optional explicit graph name;
``admin.py``: VariableService (the variable registration API) on the admin port, behind a bearer token.
"""
