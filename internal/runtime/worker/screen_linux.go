package worker

import (
	"net/http"
	"strconv"

	"github.com/dsec-project/dsec/api"
)

// screenshot answers a sandbox's screen as PNG, its size and count in
// headers.
func (w *worker) screenshot(rw http.ResponseWriter, r *http.Request) {
	e, err := w.get(r)
	if err != nil {
		fail(rw, err)
		return
	}
	b, info, err := e.sb.Screenshot(r.Context())
	if err != nil {
		fail(rw, err)
		return
	}
	h := rw.Header()
	h.Set("Content-Type", "image/png")
	h.Set("Content-Length", strconv.Itoa(len(b)))
	h.Set(api.HeaderScreenWidth, strconv.Itoa(info.Width))
	h.Set(api.HeaderScreenHeight, strconv.Itoa(info.Height))
	h.Set(api.HeaderScreenSeq, strconv.FormatInt(info.Seq, 10))
	rw.Write(b)
}

// input acts on a sandbox's keyboard or mouse.
func (w *worker) input(r *http.Request, in api.Input) (none, error) {
	e, err := w.get(r)
	if err != nil {
		return none{}, err
	}
	return none{}, e.sb.Input(r.Context(), in)
}
