"""``interleave`` and ``flat_map``: the op (``interleave``: its nodes and argument check), its
iterator (``iterator``: the cycle of slots, its checkpoint and the readers' handover), and the
reader pools that open and read its inner datasets: inline (``readers``), on threads
(``thread_readers``), in worker processes (``process_readers``) or on Ray actors
(``ray_readers``), moved between them by measurement (``placement``).
"""
