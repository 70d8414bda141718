// Command mock-nvml is built with -buildmode=c-shared into a libnvidia-ml.so.1 that answers
// NVML's C interface for a simulated machine from NVIDIA's go-nvml mocks. See hack/build-mock-nvml.sh.
package main

func main() {}
