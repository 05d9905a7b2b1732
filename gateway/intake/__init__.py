"""Image intake: fetching URLs, judging bytes, decoding and resizing to the
pixel budget, and the memory budget that admits request bodies and images.
Imports operations (metrics) and the gateway's base only."""
