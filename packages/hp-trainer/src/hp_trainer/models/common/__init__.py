"""Building blocks the families share: the dense decoder, the MoE decoder, document masks, and
the TP / EP plans of those decoders."""
