"""The engine loop, its offline API and output processing."""
