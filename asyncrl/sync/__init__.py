"""Weight sync: the broadcast collective and the pause -> broadcast -> load -> resume sequence."""
