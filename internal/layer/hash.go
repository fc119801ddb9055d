package layer

import (
	"crypto/sha256"
	"hash"
	"sync"
	"sync/atomic"

	"github.com/opencontainers/go-digest"
)

// hasher computes an image's sha256 and its window table on two other
// goroutines while the image is written: on a two-core host hashing
// costs almost no wall time.
type hasher struct {
	cur     *hbuf
	full    chan *hbuf
	win     chan *hbuf
	wg      sync.WaitGroup
	pool    sync.Pool
	fullSum hash.Hash
	wins    *windowHasher
	n       int64
	summed  bool
	lent    *hbuf
	onData  func(int)
}

type hbuf struct {
	b    []byte
	refs atomic.Int32
}

const hashChunk = 1 << 20

func newHasher(sizeHint, window int64) *hasher {
	h := &hasher{
		full: make(chan *hbuf, 16), win: make(chan *hbuf, 16),
		fullSum: sha256.New(), wins: newWindowHasher(sizeHint, window),
	}
	h.pool.New = func() any { return &hbuf{b: make([]byte, 0, hashChunk)} }
	h.wg.Add(2)
	go h.run(h.full, func(b []byte) { h.fullSum.Write(b) })
	go h.run(h.win, h.wins.Write)
	return h
}

func (h *hasher) run(ch chan *hbuf, f func([]byte)) {
	defer h.wg.Done()
	for b := range ch {
		f(b.b)
		if b.refs.Add(-1) == 0 {
			b.b = b.b[:0]
			h.pool.Put(b)
		}
	}
}

// Write takes a copy of p; it never fails.
func (h *hasher) Write(p []byte) {
	h.n += int64(len(p))
	if h.onData != nil {
		h.onData(len(p))
	}
	for len(p) > 0 {
		if h.cur == nil {
			h.cur = h.pool.Get().(*hbuf)
		}
		k := copy(h.cur.b[len(h.cur.b):cap(h.cur.b)], p)
		h.cur.b = h.cur.b[:len(h.cur.b)+k]
		p = p[k:]
		if len(h.cur.b) == cap(h.cur.b) {
			h.send()
		}
	}
}

func (h *hasher) send() {
	h.cur.refs.Store(2)
	h.full <- h.cur
	h.win <- h.cur
	h.cur = nil
}

// Sum waits for the hashing to finish and returns the digest, the byte
// count and the window table.
func (h *hasher) Sum() (digest.Digest, int64, []byte) {
	if h.summed {
		panic("hasher: Sum called twice")
	}
	h.summed = true
	if h.cur != nil && len(h.cur.b) > 0 {
		h.send()
	}
	close(h.full)
	close(h.win)
	h.wg.Wait()
	return digest.NewDigestFromBytes(digest.SHA256, h.fullSum.Sum(nil)), h.n, h.wins.Sum()
}

// Close stops the goroutines of a hasher whose Sum was never needed.
func (h *hasher) Close() {
	if !h.summed {
		h.Sum()
	}
}

// Lend returns an empty pooled buffer for the writer to fill.
func (h *hasher) Lend() []byte {
	h.lent = h.pool.Get().(*hbuf)
	return h.lent.b[:cap(h.lent.b)]
}

// Take hashes a lent buffer without copying it.
func (h *hasher) Take(b []byte) {
	if h.cur != nil && len(h.cur.b) > 0 {
		h.send()
	}
	h.n += int64(len(b))
	h.lent.b = b
	h.cur, h.lent = h.lent, nil
	h.send()
	if h.onData != nil {
		h.onData(len(b))
	}
}
