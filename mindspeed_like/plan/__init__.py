"""`mindspeed-like plan`: every rank's memory and step time for a run, before it is launched."""
