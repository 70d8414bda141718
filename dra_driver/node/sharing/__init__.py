"""GPU sharing applied on the GPU: time-slicing (compute policy) and MPS control daemons."""
