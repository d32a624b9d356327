"""Worker processes: the pool, the zygote they fork from, the worker loop, its channel and rings."""
