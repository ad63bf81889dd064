"""executor: how a run happens.

Owns the GraphExecutor (every run is a run of a LoadedClientGraph, client_graph.py, cached by its sorted
input/output/target names),
the RunHandler (the worker threads that run TensorFlow off the event loop; answers.py carries their answers back to
the event loop; batching.py makes a batch's requests one run's inputs; cost_model.py learns each graph's cost and
chooses its batch limit and runs at once, runs_at_once.py by trial; pacing.py holds lower priorities back while a
higher one arrives) and the MemoryBudget (memory.py), which admits work against the process's memory limit. A client
graph may run an op that changes the model's state or touches files only as one of the model's signatures runs it
(op_policy.py). It depends on `loader/` for loaded SavedModels and errors, and on `transfer/` for moving inputs to a
device; it knows nothing of protocols.
"""

from servex.executor.graph_executor import GraphExecutor, LoadedClientGraph, client_graph_key
from servex.executor.run_handler import RunHandler

__all__ = ["GraphExecutor", "LoadedClientGraph", "RunHandler", "client_graph_key"]
