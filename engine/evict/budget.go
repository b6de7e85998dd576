package evict

// Budget is what BytesToEvict needs to know about the cache and the file
// system at one instant. Bytes are allocated bytes (st_blocks × 512).
type Budget struct {
	// CapacityBytes bounds the whole cache; 0 means unbounded.
	CapacityBytes int64
	// UsedBytes: tracked pages that are not victims being unlinked;
	// ReservedBytes: held by in-flight saves (this one excluded).
	UsedBytes, ReservedBytes int64
	// QuotaBytes bounds the save's namespace; 0 means no quota.
	QuotaBytes int64
	// NamespaceUsedBytes, NamespaceReservedBytes: the same for the save's
	// namespace.
	NamespaceUsedBytes, NamespaceReservedBytes int64
	// AvailBytes: free bytes on the file system for unprivileged users
	// (statvfs f_bavail × f_frsize: vfs.FSStat.AvailBytes); < 0 means
	// unknown, and then no headroom applies.
	AvailBytes int64
	// HeadroomBytes: the minimum to keep free on the file system; 0: none.
	HeadroomBytes int64
	// EvictingBytes: victims chosen but not yet unlinked; their unlink will
	// free them on the file system.
	EvictingBytes int64
}

// Need is how many bytes must be freed before a save may write, per limit.
// The figures are cumulative, not additive: victims freed for the quota
// count toward the capacity and the headroom, so a save's victims must free
// max(QuotaBytes, CapacityBytes, HeadroomBytes) bytes in all, of which
// QuotaBytes from its own namespace.
type Need struct {
	// QuotaBytes must come from the save's own namespace.
	QuotaBytes int64
	// CapacityBytes and HeadroomBytes may come from the namespace or from
	// namespaces others may evict (no quota, or above it).
	CapacityBytes int64
	HeadroomBytes int64
}

// Total is the bytes the save's victims must free in all.
func (n Need) Total() int64 { return max(n.QuotaBytes, n.CapacityBytes, n.HeadroomBytes) }

// BytesToEvict says how many bytes must be evicted before a save of
// saveBytes (allocated bytes) may write:
//
//	quota:    NamespaceUsed + NamespaceReserved + save − Quota   (when Quota > 0)
//	capacity: Used + Reserved + save − Capacity                  (when Capacity > 0)
//	headroom: Headroom + save + Reserved − Avail − Evicting      (when Avail ≥ 0, Headroom > 0)
//
// each floored at 0. The headroom term is conservative: the file system has
// already subtracted the part of other saves' reservations they have
// written, which it counts again, so it may evict up to that much more than
// strictly needed; it never evicts less. A save larger than the quota or
// the capacity gets a need larger than anything evictable (the Reserve
// fails with ErrNoSpace).
func BytesToEvict(b Budget, saveBytes int64) Need {
	var n Need
	if b.QuotaBytes > 0 {
		n.QuotaBytes = max(0, b.NamespaceUsedBytes+b.NamespaceReservedBytes+saveBytes-b.QuotaBytes)
	}
	if b.CapacityBytes > 0 {
		n.CapacityBytes = max(0, b.UsedBytes+b.ReservedBytes+saveBytes-b.CapacityBytes)
	}
	if b.AvailBytes >= 0 && b.HeadroomBytes > 0 {
		n.HeadroomBytes = max(0, b.HeadroomBytes+saveBytes+b.ReservedBytes-b.AvailBytes-b.EvictingBytes)
	}
	return n
}
