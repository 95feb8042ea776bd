"""The pictures of a namespace: the report page and the live ``/ui`` (one page, one script)."""
