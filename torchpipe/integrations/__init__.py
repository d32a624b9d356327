"""Optional tools around a pipeline: progress bars (tqdm), trace export (Chrome / Perfetto JSON) and
timeline plots (matplotlib). Each imports its library only when used and names the extra that
installs it when it is missing.
"""
