"""The one cost model: parameters, FLOPs, (later) memory and communication, and the hardware table."""
