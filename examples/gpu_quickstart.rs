//! The README's GPU section, as a program that compiles and runs (tests/readme.rs checks that
//! the README shows exactly the lines between the markers).
//!
//! ```sh
//! cargo run --release --features cuda --example gpu_quickstart
//! ```

fn main() {
    if let Err(e) = run() {
        eprintln!("gpu_quickstart: {e}");
        std::process::exit(1);
    }
}

fn run() -> kvq::Result<()> {
    // README:begin
    use kvq::cache::{BlockAllocator, Reservation};
    use kvq::cuda::decode::{DecodeStep, RowStrides};
    use kvq::cuda::{
        DecodeCapacity, DecodePlan, DecodeWorkspace, DeviceBlockTables, DeviceCache, Gpu, ops,
    };
    use kvq::{CacheConfig, KvFormat};

    // kvq's own stream here; Gpu::from_stream / Gpu::from_raw take the engine's.
    let gpu = Gpu::new(0)?;
    let s = gpu.stream().clone();
    let (heads, kv_heads, d, block) = (32, 8, 128, 16);
    let config = CacheConfig::new(
        kv_heads,
        d,
        block,
        KvFormat::Int4Sym32,
        KvFormat::Int4Affine64,
    )?;
    let num_blocks = 4096;
    let mut cache = DeviceCache::new(&gpu, config, num_blocks)?; // one layer's pool
    let mut alloc = BlockAllocator::for_config(&config, num_blocks)?; // one for every layer

    // Once, for the capacity: the plan, its workspace and the block tables.
    let (max_batch, max_q_len, max_context_len) = (64, 1, 8192);
    let capacity = DecodeCapacity {
        max_batch,
        num_q_heads: heads,
        max_q_len,
        max_context_len,
    };
    let plan = DecodePlan::new(&gpu, cache.layout(), capacity)?;
    let mut ws = DecodeWorkspace::new(&plan)?;
    let mut tables = DeviceBlockTables::with_capacity(&cache, capacity.into())?;
    // The engine's tensors: K/V rows [tokens, kv_heads, d], q and out [tokens, heads, d].
    let k_new = s.alloc_zeros::<kvq::half::f16>(max_batch * kv_heads * d)?;
    let v_new = s.alloc_zeros::<kvq::half::f16>(max_batch * kv_heads * d)?;
    let q = s.alloc_zeros::<kvq::half::f16>(max_batch * heads * d)?;
    let mut out = s.alloc_zeros::<f32>(max_batch * heads * d)?; // any output type
    let mut step_slots: Vec<i32> = Vec::with_capacity(max_batch); // the step's slot mapping
    let mut slots = s.alloc_zeros::<i32>(max_batch)?; // and its device copy, made once
    let mut r = Reservation::default(); // a sequence's new slots and copies, reused

    // Every step, for each sequence (here one, in batch row 0): slots for its new token, the
    // copy-on-write copies of a forked sequence, the append, the row; then one decode.
    let seq = alloc.create_sequence();
    alloc.reserve_into(seq, 1, &mut r)?;
    cache.copy_blocks(&r.copies)?;
    step_slots.clear();
    r.extend_slots(&mut step_slots)?; // checked: a slot past i32 is an error, never a wrap
    s.memcpy_htod(&step_slots, &mut slots)?; // into the buffer made once: no allocation
    ops::append(&mut cache, &slots, &k_new, &v_new, step_slots.len())?;
    tables.set_row(0, alloc.block_table(seq)?, alloc.len(seq)?)?;
    tables.set_batch(1)?; // rows past the batch are ignored; rows of length 0 are padding
    tables.upload()?; // one async copy of what changed, from pinned memory
    let rows = RowStrides::token_major(heads, 1, d);
    plan.decode_step(
        &mut ws,
        &cache,
        &tables,
        DecodeStep {
            q_len: 1,
            q: &q,
            q_rows: rows,
            out: &mut out,
            out_rows: rows,
            lse: None,
            sinks: None, // or Some(&sinks): a learned logit per query head (gpt-oss)
            alibi_slopes: None, // or Some(&slopes): ALiBi's slope per query head
        },
    )?; // queued on the plan's stream: no allocation, no host sync, capturable in a graph
    cache.check_appends()?; // now and then: slots or block ids outside the pool are errors
    // (`take_counters()` instead gives every count, the inputs appends saturated among them)
    // README:end
    println!("decoded one step: {} output values", out.len());

    // README:prefill-begin
    use kvq::cuda::prefill::{
        PrefillCapacity, PrefillPlan, PrefillStep, PrefillWorkspace, QoIndptr, TokenRows,
    };

    // Once: a plan for up to 64 sequences and 2048 new tokens per step (options as the model
    // needs them), and its workspace.
    let max_tokens = 2048;
    let pplan = PrefillPlan::new(
        &gpu,
        cache.layout(),
        PrefillCapacity {
            max_batch,
            num_q_heads: heads,
            max_tokens,
            max_context_len,
        },
    )?
    .with_window_left(None)? // Some(w): a sliding window of w + 1 positions
    .with_logits_soft_cap(None)?; // Some(c): c * tanh(logit / c)
    let mut pws = PrefillWorkspace::new(&pplan)?;
    let chunk_q = s.alloc_zeros::<kvq::half::f16>(max_tokens * heads * d)?;
    let mut chunk_out = s.alloc_zeros::<kvq::half::f16>(max_tokens * heads * d)?;
    let chunk_k = s.alloc_zeros::<kvq::half::f16>(max_tokens * kv_heads * d)?;
    let chunk_v = s.alloc_zeros::<kvq::half::f16>(max_tokens * kv_heads * d)?;
    let mut chunk_slots = s.alloc_zeros::<i32>(max_tokens)?;
    let mut qo = QoIndptr::new(&gpu, max_batch)?; // the step's offsets, host and device

    // A step that prefills a chunk of 100 prompt tokens of `seq`: append them, set the row
    // (its length includes them), put the step's offsets on the device, one launch.
    let n = 100;
    alloc.reserve_into(seq, n, &mut r)?;
    cache.copy_blocks(&r.copies)?;
    step_slots.clear();
    r.extend_slots(&mut step_slots)?;
    s.memcpy_htod(&step_slots, &mut chunk_slots)?;
    ops::append(&mut cache, &chunk_slots, &chunk_k, &chunk_v, n)?;
    tables.set_row(0, alloc.block_table(seq)?, alloc.len(seq)?)?;
    tables.upload()?;
    qo.set_counts(&[n])?; // sequence b's new tokens are rows qo[b]..qo[b + 1]
    let rows = TokenRows::contiguous(heads, d); // [tokens, heads, d]
    pplan.prefill(
        &mut pws,
        &cache,
        &tables,
        PrefillStep {
            qo_indptr: qo.host(),
            qo_indptr_dev: qo.device(),
            q: &chunk_q,
            q_rows: rows,
            out: &mut chunk_out,
            out_rows: rows,
            lse: None,          // or Some((&mut lse, rows)): natural-log lse per row
            sinks: None,        // or Some(&sinks): a learned logit per query head (gpt-oss)
            alibi_slopes: None, // or Some(&slopes): ALiBi's slope per query head
        },
    )?;
    cache.check_appends()?;
    // README:prefill-end
    println!("prefilled a chunk of {n} tokens");
    Ok(())
}
