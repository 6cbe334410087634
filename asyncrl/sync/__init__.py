"""Weight sync's transports: the broadcast collective, its group store and the shared region.
The sequence that drives them (pause -> broadcast -> load -> resume) coordinates the trainer and
the engines, so it is in the control layer: asyncrl/control/weight_sync.py."""
