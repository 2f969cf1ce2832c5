"""One module per source of trace files; `sandbox/traces/formats.py` names, detects and runs them.

Each module reads one family of files into traces: `claims(source)` says whether a file (a
`reading.Source`) is of its format, `read(source)` returns its traces with their lines, and its
docstring says field by field what it reads and what it drops. Readers decide ids, metadata and
provenance; formats.py checks each trace and decides text actions for all of them alike.
"""
