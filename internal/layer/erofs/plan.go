package erofs

import (
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
)

// ReadAtCloser is an open planned file.
type ReadAtCloser interface {
	io.ReaderAt
	io.Closer
}

// Planned is a regular file whose bytes Finish reads, so that the whole
// image, superblock first, is written in one sequential pass an observer
// can hash as it goes.
type Planned struct {
	// Open opens the file when its data is due.
	Open func() (ReadAtCloser, error)
	// Prefetch, if set, asks for the file's data to be read ahead; it
	// runs on another goroutine, a bounded distance before Open.
	Prefetch func()
	// Holes marks the HoleSize units that are all zeros (nil: none).
	// The last unit counts only if a hole precedes it, as when streaming.
	Holes []bool
}

// Plan adds a regular file whose data is read by Finish. Finish assigns
// its blocks: without SetOrder the same blocks Create would for the same
// content, so a planned image and a streamed one of the same tree are
// byte-identical.
func (w *Writer) Plan(p string, a Attr, size int64, pl Planned) error {
	if w.started {
		return errors.New("erofs: Plan after Create: an image is either streamed or planned")
	}
	if size < 0 {
		return fmt.Errorf("%w: %q: negative size", ErrInvalid, p)
	}
	a.Mode = a.Mode&^S_IFMT | S_IFREG
	ino := &inode{Attr: a, size: uint64(size), plan: &pl}
	if err := checkAttr(p, &ino.Attr); err != nil {
		return err
	}
	if _, _, err := w.lookup(p); err != nil {
		return err
	}
	units := (ino.size + HoleSize - 1) / HoleSize
	if pl.Holes != nil && uint64(len(pl.Holes)) != units {
		return fmt.Errorf("erofs: plan %q: %d hole flags for %d units", p, len(pl.Holes), units)
	}
	ino.rank = len(w.rank)
	if parts, err := SplitPath(p); err == nil {
		if r, ok := w.rank[strings.Join(parts, "/")]; ok {
			ino.rank = r
		}
	}
	if err := w.place(p, ino); err != nil {
		return err
	}
	w.planned = append(w.planned, ino)
	return nil
}

// Hot names a planned file for SetOrder and the parts of it that go
// first: Blocks are ranges of the file's BlockSize blocks; nil means the
// whole file.
type Hot struct {
	Path   string
	Blocks []BlockRange
}

// BlockRange is Count blocks of a file from block Start.
type BlockRange struct{ Start, Count uint64 }

// SetOrder asks Finish to place the data named in hot first, in that
// order, ahead of every other block (the rest keep plan order). A run
// that reads those parts then reads one contiguous range of the image
// instead of spots scattered over it: the layout a recorded access
// profile asks for. A file only partly named is stored chunk-based with
// one chunk per block, so its named blocks can be hot and the others
// cold. Paths never planned are ignored. It must be called before Plan.
func (w *Writer) SetOrder(hot []Hot) error {
	if len(w.planned) > 0 {
		return errors.New("erofs: SetOrder after Plan")
	}
	w.rank = make(map[string]int, len(hot))
	w.hot = nil
	for _, h := range hot {
		parts, err := SplitPath(h.Path)
		if err != nil {
			return err
		}
		k := strings.Join(parts, "/")
		if r, ok := w.rank[k]; ok {
			if w.hot[r] != nil && h.Blocks != nil {
				w.hot[r] = append(w.hot[r], h.Blocks...)
			} else {
				w.hot[r] = nil // the whole file
			}
			continue
		}
		w.rank[k] = len(w.rank)
		w.hot = append(w.hot, h.Blocks)
	}
	return nil
}

// assignPlanned gives every planned file its blocks and returns the end
// of the hot ones (1 when none): first the parts SetOrder named, in its
// order, then every other file whole in plan order, then the rest of the
// files SetOrder named only in part. Without SetOrder the blocks follow
// plan order, as Create would assign them.
func (w *Writer) assignPlanned() (uint32, error) {
	slices.SortStableFunc(w.planned, func(a, b *inode) int { return a.rank - b.rank })
	var split, cold []*inode
	rest := w.planned
	for len(rest) > 0 && rest[0].rank < len(w.rank) {
		ino := rest[0]
		rest = rest[1:]
		if ranges := w.hot[ino.rank]; ranges == nil || w.coversAll(ino, ranges) {
			if err := w.assignWhole(ino); err != nil {
				return 0, err
			}
			continue
		}
		// One chunk per block: 0 (block 0 is the superblock) marks one
		// not assigned yet.
		ino.chunkBits = 0
		ino.chunks = make([]uint32, (ino.size+BlockSize-1)/BlockSize)
		start := w.nextBlk
		for _, r := range w.hot[ino.rank] {
			for b := r.Start; b < min(r.Start+r.Count, uint64(len(ino.chunks))); b++ {
				if ino.chunks[b] == 0 && !ino.holeBlock(b) {
					ino.chunks[b] = w.nextBlk
					if err := w.reserve(BlockSize); err != nil {
						return 0, err
					}
				}
			}
		}
		if w.nextBlk == start { // the ranges name no data it has: not hot at all
			ino.chunks = nil
			cold = append(cold, ino)
			continue
		}
		split = append(split, ino)
	}
	hotEnd := w.nextBlk
	if len(w.rank) == 0 {
		// No order, no hot region: in a streamed image the data is
		// all written by now, and would have been taken for it.
		hotEnd = 1
	}
	for _, ino := range append(cold, rest...) {
		if err := w.assignWhole(ino); err != nil {
			return 0, err
		}
	}
	for _, ino := range split {
		for b, c := range ino.chunks {
			switch {
			case ino.holeBlock(uint64(b)):
				ino.chunks[b] = nullAddr
			case c == 0:
				ino.chunks[b] = w.nextBlk
				if err := w.reserve(BlockSize); err != nil {
					return 0, err
				}
			}
		}
	}
	return hotEnd, nil
}

// coversAll says whether ranges name every data block of ino.
func (w *Writer) coversAll(ino *inode, ranges []BlockRange) bool {
	n := (ino.size + BlockSize - 1) / BlockSize
	seen := make([]bool, n)
	for _, r := range ranges {
		for b := r.Start; b < min(r.Start+r.Count, n); b++ {
			seen[b] = true
		}
	}
	for b := range seen {
		if !seen[b] && !ino.holeBlock(uint64(b)) {
			return false
		}
	}
	return true
}

// holeBlock says whether block b of a planned file lies in a hole unit.
func (ino *inode) holeBlock(b uint64) bool {
	u := b * BlockSize / HoleSize
	return ino.plan.Holes != nil && ino.plan.Holes[u]
}

// assignWhole gives a planned file its blocks in file order.
func (w *Writer) assignWhole(ino *inode) error {
	var bp blockPlan
	bp.begin(w)
	units := (ino.size + HoleSize - 1) / HoleSize
	for u := uint64(0); u < units; u++ {
		n := min(HoleSize, ino.size-u*HoleSize)
		if bp.hole(w, n, ino.plan.Holes != nil && ino.plan.Holes[u]) {
			continue
		}
		if err := w.reserve(n); err != nil {
			return err
		}
	}
	bp.end(w, ino)
	return nil
}

// segment is a run of a planned file's bytes stored at consecutive
// blocks of the image.
type segment struct {
	ino    *inode
	off, n uint64 // bytes of the file
	blk    uint32 // where they go
	last   bool   // the file's last segment: prefetch credit is due
}

// segments lists where every planned byte goes, in image order.
func (w *Writer) segments() []segment {
	var segs []segment
	for _, ino := range w.planned {
		first := len(segs)
		switch {
		case ino.chunks != nil:
			per := uint64(BlockSize) << ino.chunkBits
			for c, addr := range ino.chunks {
				off := uint64(c) * per
				if addr == nullAddr || off >= ino.size {
					continue
				}
				n := min(per, ino.size-off)
				if l := len(segs) - 1; l >= first && segs[l].off+segs[l].n == off &&
					segs[l].blk+uint32(segs[l].n/BlockSize) == addr && segs[l].n%BlockSize == 0 {
					segs[l].n += n
					continue
				}
				segs = append(segs, segment{ino: ino, off: off, n: n, blk: addr})
			}
		case ino.size > 0:
			segs = append(segs, segment{ino: ino, n: ino.size, blk: ino.blkaddr})
		}
		if len(segs) > first {
			segs[len(segs)-1].last = true
		}
	}
	slices.SortStableFunc(segs, func(a, b segment) int { return int(a.blk) - int(b.blk) })
	return segs
}

// prefetchAhead bounds how far ahead of the writer Prefetch runs.
const prefetchAhead = 64 << 20

// emitPlanned writes the data of every planned file in image order,
// while another goroutine prefetches the files ahead of it, so a cold
// source is read with many requests in flight instead of one.
func (w *Writer) emitPlanned() error {
	segs := w.segments()
	credit := make(chan int64, len(segs)+1)
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		var ahead int64
		for _, sg := range segs {
			if sg.ino.plan.Prefetch == nil || sg.ino.prefetched {
				continue
			}
			for ahead > prefetchAhead {
				select {
				case n := <-credit:
					ahead -= n
				case <-stop:
					return
				}
			}
			sg.ino.prefetched = true
			sg.ino.plan.Prefetch()
			ahead += int64(sg.ino.size)
		}
	}()
	var (
		cur *inode
		f   ReadAtCloser
	)
	defer func() {
		if f != nil {
			f.Close()
		}
	}()
	for _, sg := range segs {
		if sg.ino != cur {
			if f != nil {
				f.Close()
				f = nil
			}
			var err error
			if f, err = sg.ino.plan.Open(); err != nil {
				return err
			}
			cur = sg.ino
		}
		if err := w.emitSegment(f, sg); err != nil {
			return err
		}
		if sg.last && sg.ino.plan.Prefetch != nil {
			credit <- int64(sg.ino.size)
		}
	}
	return nil
}

// emitSegment copies a segment's bytes from f, padding the file's last
// block with zeros.
func (w *Writer) emitSegment(f ReadAtCloser, sg segment) error {
	for done := uint64(0); done < sg.n; {
		n := min(uint64(len(w.buf)), sg.n-done)
		b := w.buf[:n]
		if w.observe != nil {
			b = w.observe.Lend()[:n]
		}
		if _, err := f.ReadAt(b, int64(sg.off+done)); err != nil {
			if errors.Is(err, io.EOF) {
				return fmt.Errorf("%w: a file shrank while the layer was built; build again from a tree nothing writes to", ErrInvalid)
			}
			return err
		}
		if _, err := w.bw.Write(b); err != nil {
			w.err = err
			return err
		}
		if w.observe != nil {
			w.observe.Take(b)
		}
		done += n
	}
	if pad := int(-sg.n & (BlockSize - 1)); pad > 0 {
		return w.emit(w.zero[:pad])
	}
	return nil
}

// emit writes b in image order and shows it to the observer.
func (w *Writer) emit(b []byte) error {
	if w.observe != nil {
		w.observe.Write(b)
	}
	if _, err := w.bw.Write(b); err != nil {
		w.err = err
		return err
	}
	return nil
}
