raise ImportError("this build must never be imported on a CPU-only system")
