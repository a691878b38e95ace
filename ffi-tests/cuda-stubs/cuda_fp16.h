/* Stand-in: nccl.h only includes it. */
