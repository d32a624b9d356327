"""``interleave`` and ``flat_map``: the node and its iterator (``interleave``), and the reader
pools that open and read its inner datasets: inline (``readers``), on threads
(``thread_readers``), in worker processes (``process_readers``) or on Ray actors
(``ray_readers``), moved between them by measurement (``placement``).
"""
