"""The torch-free core: operations, a task's program, the memory ledger, scheduling
policies, traces and the scheduling simulator. Nothing here imports torch or Ray, so
front ends and tools can plan, validate and simulate without either."""
