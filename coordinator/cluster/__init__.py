"""The stages and their hosts: the stage interface, discovery, placement, heartbeats, re-plans."""
