"""Execution shared by every parallel op, in four rooms and a hall.

- ``processes/``: worker processes: the pool, the zygote they fork from, the worker loop, the
  channel, the shared-memory rings.
- ``codec/``: what crosses a process boundary and how (tensors raw, the rest pickle-5).
- ``ray/``: Ray actors as one more executor.
- ``placement/``: where a stage's calls run: the policy, the measure-and-move driver, the costs
  they read (GIL, memory).
- the hall (this folder): the executors' contract and thread pool, routing, ordered-delivery
  dispatch and the stall watchdog, timing, CPU budget, counts, recycled batch memory.
"""
