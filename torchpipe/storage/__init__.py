"""torchpipe's own on-disk formats, and the files they are written through.

- ``pending_file``: a file written under a temporary name and published when complete (a full
  disk is a ``tp.DiskFullError`` naming the file and the bytes written);
- ``cache_file``: the ``cache(path)`` file (docs/cache.md);
- ``saved_file``: a saved dataset's record files and manifest, written and read (docs/save.md);
- ``save_writers``: the threads that write a save's record files; ``save``: ``ds.save(path)``;
- ``element_spec``: the structure, dtypes and shapes a manifest records;
- ``fingerprint``: one line per op, for checkpoints, cache files and snapshot directories.
"""
