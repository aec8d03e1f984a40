"""Memory of common CUDA devices, for a capacity the evidence does not state."""
from __future__ import annotations

# The memory common CUDA devices have, in GiB, as CUDA reports it (totalGlobalMem, torch's
# total_memory): what an allocation can use, below the GB the card is sold as (an "80GB" A100 has
# 79.15 GiB). Used only when neither the user nor the evidence says how big the device was. From
# recorded deviceProperties (the fixtures' V100 32GB, A100 40GB, A100 80GB and H100 80GB (79.18);
# an H200's in a Kineto trace published with mlcommons/chakra) and torch's OOM messages ("GPU 0 has
# a total capacity of ..."), taking the smallest figure seen for a card. Cards whose CUDA total was
# not found (H100 NVL, B200) are left out rather than guessed.
COMMON_DEVICES_GIB = {14.56: "16 GB T4", 15.75: "16 GB V100", 22.2: "24 GB A10G", 23.68: "24 GB RTX 4090",
                      31.74: "32 GB V100", 39.39: "40 GB A100", 44.53: "48 GB L40S", 79.15: "80 GB A100/H100",
                      139.84: "141 GB H200"}
COMMON_CAPACITIES_GIB = list(COMMON_DEVICES_GIB)
