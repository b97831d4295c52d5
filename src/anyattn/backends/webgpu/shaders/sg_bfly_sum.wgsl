// SUBGROUPS: sm <- the sum of sm over the TX lanes of this thread row (a
// shuffle-xor butterfly; TX a power of two <= 32, the subgroup >= TX lanes: sg_ok).
// Every lane ends with the same value (each step combines the same two operands).
if (TX > 16u) { sm = sm + subgroupShuffleXor(sm, 16u); }
if (TX > 8u) { sm = sm + subgroupShuffleXor(sm, 8u); }
if (TX > 4u) { sm = sm + subgroupShuffleXor(sm, 4u); }
if (TX > 2u) { sm = sm + subgroupShuffleXor(sm, 2u); }
if (TX > 1u) { sm = sm + subgroupShuffleXor(sm, 1u); }
