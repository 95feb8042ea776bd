"""The control plane for workers: topology changes published through the log like any other
event, checked before they are published and confirmed once the read model shows them."""
