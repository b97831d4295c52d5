// SUBGROUPS: mx <- the max of mx over the TX lanes of this thread row (a
// shuffle-xor butterfly; TX a power of two <= 32, the subgroup >= TX lanes: sg_ok).
// Every lane ends with the same value (each step combines the same two operands).
if (TX > 16u) { mx = max(mx, subgroupShuffleXor(mx, 16u)); }
if (TX > 8u) { mx = max(mx, subgroupShuffleXor(mx, 8u)); }
if (TX > 4u) { mx = max(mx, subgroupShuffleXor(mx, 4u)); }
if (TX > 2u) { mx = max(mx, subgroupShuffleXor(mx, 2u)); }
if (TX > 1u) { mx = max(mx, subgroupShuffleXor(mx, 1u)); }
