"""Seeing a pipeline run: trace recording, its export (Chrome / Perfetto JSON), timeline plots and
progress bars. Low in the layers: anything may import it; it imports only the constants. Each
optional library (tqdm, matplotlib) is imported when used, with an error naming the extra."""
