"""``--backend genie``: libGenie through ctypes (libgenie.py: the dialog; libpipeline.py: pipelines
and nodes), the folder's checks, and the model classes that drive them."""
