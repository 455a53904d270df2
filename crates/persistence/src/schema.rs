// @generated automatically by Diesel CLI.

diesel::table! {
    item_inputs (tenant_id, item_id, input_sha256) {
        tenant_id -> Text,
        item_id -> Text,
        input_sha256 -> Text,
        input_text -> Text,
        replaced_at -> Timestamptz,
    }
}

diesel::table! {
    items (id) {
        tenant_id -> Text,
        id -> Text,
        input_text -> Text,
        input_sha256 -> Text,
        s3_key -> Text,
        created_at -> Timestamptz,
        superseded_at -> Nullable<Timestamptz>,
    }
}

diesel::table! {
    items_open (slot, tenant_id, item_id) {
        slot -> Int2,
        tenant_id -> Text,
        item_id -> Text,
        opened_at -> Timestamptz,
    }
}

diesel::table! {
    items_open_0 (slot, tenant_id, item_id) {
        slot -> Int2,
        tenant_id -> Text,
        item_id -> Text,
        opened_at -> Timestamptz,
    }
}

diesel::table! {
    items_open_1 (slot, tenant_id, item_id) {
        slot -> Int2,
        tenant_id -> Text,
        item_id -> Text,
        opened_at -> Timestamptz,
    }
}

diesel::table! {
    items_open_2 (slot, tenant_id, item_id) {
        slot -> Int2,
        tenant_id -> Text,
        item_id -> Text,
        opened_at -> Timestamptz,
    }
}

diesel::table! {
    items_open_3 (slot, tenant_id, item_id) {
        slot -> Int2,
        tenant_id -> Text,
        item_id -> Text,
        opened_at -> Timestamptz,
    }
}

diesel::table! {
    audit_log (id) {
        id -> Text,
        tenant_id -> Text,
        entity_id -> Text,
        action -> Text,
        run_id -> Nullable<Text>,
        attempt -> Nullable<Int4>,
        details -> Jsonb,
        created_at -> Timestamptz,
    }
}

diesel::table! {
    jobs (id) {
        id -> Text,
        queue -> Text,
        state -> Text,
        priority -> Int4,
        payload -> Jsonb,
        singleton_key -> Nullable<Text>,
        singleton_on -> Nullable<Timestamptz>,
        retry_limit -> Int4,
        retry_count -> Int4,
        retry_delay_ms -> Int8,
        retry_backoff -> Bool,
        retry_delay_max_ms -> Nullable<Int8>,
        expire_in_ms -> Int8,
        attempt -> Int4,
        start_after -> Timestamptz,
        started_at -> Nullable<Timestamptz>,
        lease_expires_at -> Nullable<Timestamptz>,
        completed_at -> Nullable<Timestamptz>,
        created_at -> Timestamptz,
        dead_letter -> Nullable<Text>,
        output -> Nullable<Jsonb>,
        last_error -> Nullable<Text>,
        tenant_id -> Text,
        ready_seq -> Int8,
    }
}

diesel::table! {
    job_claims (ready_seq) {
        ready_seq -> Int8,
        job_id -> Text,
        attempt -> Int4,
        queue -> Text,
        tenant_id -> Text,
        priority -> Int4,
        claim_xid -> Int8,
        claimed_at -> Timestamptz,
        lease_expires_at -> Timestamptz,
    }
}

diesel::table! {
    job_closures (ready_seq) {
        ready_seq -> Int8,
        job_id -> Text,
        attempt -> Int4,
        queue -> Text,
        tenant_id -> Text,
        priority -> Int4,
        outcome -> Text,
        output -> Nullable<Jsonb>,
        closed_at -> Timestamptz,
    }
}

diesel::table! {
    job_keys (queue, singleton_key) {
        queue -> Text,
        singleton_key -> Text,
        job_id -> Text,
        tenant_id -> Text,
    }
}

diesel::table! {
    job_windows (job_id) {
        job_id -> Text,
        queue -> Text,
        singleton_key -> Text,
        singleton_on -> Timestamptz,
        tenant_id -> Text,
    }
}

diesel::table! {
    job_expiry_mark (only_row) {
        only_row -> Bool,
        expired_to -> Timestamptz,
        xid_horizon -> Int8,
    }
}

diesel::table! {
    job_walk_mark (only_row) {
        only_row -> Bool,
        walked_from -> Nullable<Int8>,
        sample_mark -> Nullable<Int8>,
        sample_senders -> Array<Nullable<Text>>,
    }
}

diesel::table! {
    job_lanes (queue, tenant_id, priority) {
        queue -> Text,
        tenant_id -> Text,
        priority -> Int4,
        floor -> Int8,
        floor_at -> Timestamptz,
        parked -> Bool,
    }
}

diesel::table! {
    stage_attempt_ends (run_id, attempt) {
        run_id -> Text,
        attempt -> Int4,
        tenant_id -> Text,
        worker_id -> Text,
        input_hash -> Text,
        started_at -> Timestamptz,
        finished_at -> Timestamptz,
        outcome -> Text,
        error -> Nullable<Text>,
        upstream_attempt -> Nullable<Int4>,
    }
}

diesel::table! {
    stage_runs (id) {
        id -> Text,
        tenant_id -> Text,
        item_id -> Text,
        stage -> Text,
        status -> Text,
        attempts -> Int4,
        max_attempts -> Int4,
        input_hash -> Text,
        worker_id -> Text,
        started_at -> Timestamptz,
        lease_expires_at -> Timestamptz,
        finished_at -> Nullable<Timestamptz>,
        last_error -> Nullable<Text>,
        created_at -> Timestamptz,
        success_attempt -> Nullable<Int4>,
        upstream_stage -> Nullable<Text>,
        upstream_attempt -> Nullable<Int4>,
        interruptions -> Int4,
        interrupted_attempt -> Nullable<Int4>,
        stopped_attempt -> Nullable<Int4>,
        output -> Nullable<Jsonb>,
    }
}

diesel::table! {
    queue_buckets (queue, tenant_id) {
        queue -> Text,
        tenant_id -> Text,
        tokens -> Float8,
        refilled_at -> Timestamptz,
        held_until -> Nullable<Timestamptz>,
    }
}

diesel::table! {
    queue_control_changes (id) {
        id -> Int8,
        changed_at -> Timestamptz,
        queue -> Text,
        scope -> Text,
        change -> Text,
        paused -> Nullable<Bool>,
        max_active -> Nullable<Int4>,
        rate_count -> Nullable<Int4>,
        rate_period_ms -> Nullable<Int8>,
        rate_burst -> Nullable<Int4>,
        weight -> Nullable<Int4>,
        actor -> Nullable<Text>,
        db_user -> Text,
        aging_ms -> Nullable<Int8>,
    }
}

diesel::table! {
    queue_controls (queue, scope) {
        queue -> Text,
        scope -> Text,
        paused -> Bool,
        max_active -> Nullable<Int4>,
        rate_count -> Nullable<Int4>,
        rate_period_ms -> Nullable<Int8>,
        rate_burst -> Nullable<Int4>,
        weight -> Nullable<Int4>,
        updated_at -> Timestamptz,
        updated_by -> Text,
        aging_ms -> Nullable<Int8>,
    }
}

diesel::table! {
    stage_checkpoints (run_id) {
        run_id -> Text,
        tenant_id -> Text,
        input_hash -> Text,
        upstream_attempt -> Nullable<Int4>,
        attempt -> Int4,
        prepared -> Jsonb,
        written_at -> Timestamptz,
    }
}

diesel::table! {
    stage_reruns (run_id, after_attempt) {
        tenant_id -> Text,
        run_id -> Text,
        after_attempt -> Int4,
        actor -> Text,
        bulk_id -> Nullable<Text>,
        created_at -> Timestamptz,
    }
}

diesel::table! {
    stage_waits (run_id, attempt) {
        tenant_id -> Text,
        run_id -> Text,
        attempt -> Int4,
        stage -> Text,
        signal -> Nullable<Text>,
        wait_until -> Timestamptz,
        on_timeout -> Text,
        created_at -> Timestamptz,
        ended_at -> Nullable<Timestamptz>,
        ended_by -> Nullable<Text>,
        payload -> Nullable<Jsonb>,
        actor -> Nullable<Text>,
    }
}

diesel::table! {
    bulk_actions (id) {
        id -> Text,
        action -> Text,
        filter -> Jsonb,
        actor -> Text,
        batch_size -> Int4,
        done_tenant -> Nullable<Text>,
        done_item -> Nullable<Text>,
        selected -> Int4,
        acted -> Int4,
        batches -> Int4,
        created_at -> Timestamptz,
        updated_at -> Timestamptz,
        finished_at -> Nullable<Timestamptz>,
    }
}

diesel::table! {
    fanouts (tenant_id, parent_item, stage, attempt) {
        tenant_id -> Text,
        parent_item -> Text,
        stage -> Text,
        attempt -> Int4,
        gather_stage -> Text,
        input_hash -> Text,
        children -> Int4,
        final_children -> Int4,
        version -> Int4,
        created_at -> Timestamptz,
        completed_at -> Nullable<Timestamptz>,
        superseded_at -> Nullable<Timestamptz>,
    }
}

diesel::table! {
    fanout_children (tenant_id, item_id) {
        tenant_id -> Text,
        item_id -> Text,
        parent_item -> Text,
        stage -> Text,
        attempt -> Int4,
        child_key -> Text,
        position -> Int4,
        outcome -> Nullable<Text>,
        final_stage -> Nullable<Text>,
        finished_at -> Nullable<Timestamptz>,
    }
}

diesel::allow_tables_to_appear_in_same_query!(
    bulk_actions,
    fanout_children,
    fanouts,
    item_inputs,
    items,
    items_open,
    items_open_0,
    items_open_1,
    items_open_2,
    items_open_3,
    job_claims,
    job_closures,
    job_expiry_mark,
    job_lanes,
    job_keys,
    job_windows,
    job_walk_mark,
    audit_log,
    jobs,
    stage_attempt_ends,
    stage_runs,
    queue_buckets,
    queue_control_changes,
    queue_controls,
    stage_checkpoints,
    stage_reruns,
    stage_waits,
);
