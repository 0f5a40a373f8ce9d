// q4_gemv.cu's ROPE epilogue (its ROPE_EPILOGUE), in a build of its own: the other builds
// keep their five inputs, since each input costs the host a little at every launch. The
// pair's other value (rope_store.cu's PAIR) is the other feature's sum, rounded.
        float y = static_cast<float>(static_cast<T>(sum));  // the product, rounded
#define PAIR static_cast<float>(static_cast<T>(other))
//@ ROPE_STORE
#undef PAIR
