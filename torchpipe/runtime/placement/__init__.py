"""Where a stage's calls run: the policy that compares executors (``policy.py``), the first calls'
measurement (``measure.py``) and the costs it reads (``gil.py``, ``memory_costs.py``), the driver
that judges a running stage window by window (``driver.py``), the placement that moves its calls
(``placement.py``), and the one builder of a stage placed that way (``auto_stage.py``: map's calls and
the DataLoader's batches)."""
