"""The compiler: the Dynamo backend, its stage list, the marker ops and the cost model."""
