"""Node labels in the format of NVIDIA's GPU feature discovery, for nodeSelector and affinity."""
