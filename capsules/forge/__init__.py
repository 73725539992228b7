"""The forge capsule: forged tools over the bus (see ``capsule.py``)."""
