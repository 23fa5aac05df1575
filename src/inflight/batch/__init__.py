"""OpenAI's Batch API inside the engine: the job store (SQLite and a data
directory), the batch file formats, and the service whose feeder runs batch
lines at background priority."""
