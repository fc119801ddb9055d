package e2b

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"mime"
	"mime/multipart"
	"net/http"
	"net/http/httputil"
	"net/url"
	"path"
	"strconv"
	"sync/atomic"

	"connectrpc.com/connect"
	"github.com/containerd/errdefs"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/dsec-project/dsec/api"
	fspb "github.com/dsec-project/dsec/internal/e2b/envd/filesystem"
	"github.com/dsec-project/dsec/internal/e2b/envd/filesystem/filesystemconnect"
	"github.com/dsec-project/dsec/internal/e2b/envd/process/processconnect"
	"github.com/dsec-project/dsec/sdk"
)

// maxUpload bounds one file a /files upload writes (the sandbox's disk
// bounds what it writes in all).
const maxUpload = 1 << 30

// maxMessage bounds a Connect request's message, decompressed: a
// command and its environment, a chunk of stdin, a path.
const maxMessage = 4 << 20

// envdAuth serves an envd request only with a token that opens its
// sandbox (envdCaller), checked before anything of the request is read:
// neither a body nor a compressed message of a request without one is
// ever decoded.
func (s *Server) envdAuth(next http.Handler) http.Handler {
	return http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		if r.URL.Query().Get("signature") != "" && r.Header.Get("X-Access-Token") == "" {
			refuse(rw, r, fmt.Errorf("signed file URLs are not served by dsec's E2B front: send the access token (X-Access-Token): %w", errdefs.ErrUnauthenticated))
			return
		}
		who, release, ok := s.admit(rw, r, sandboxOf(r.Context()), r.Header.Get("X-Access-Token"))
		if !ok {
			return
		}
		defer release()
		if connectErrors.IsSupported(r) { // one message (no RPC served streams its input): it comes at once
			r.Body = readBy(rw, r.Body)
		}
		next.ServeHTTP(rw, r.WithContext(withCaller(r.Context(), who)))
	})
}

// admit lets a request for sandbox id in with token, holding a request
// slot of its caller's (release it), or refuses it, unread.
func (s *Server) admit(rw http.ResponseWriter, r *http.Request, id, token string) (caller, func(), bool) {
	if via, ok := relayed(r.Context()); ok { // its slot held by the worker
		who, err := s.relayedCaller(id, token, via)
		if err != nil {
			refuse(rw, r, err)
			return caller{}, nil, false
		}
		return who, func() {}, true
	}
	who, err := s.envdCaller(id, token)
	var release func()
	if err == nil {
		release, err = s.hold(who)
	}
	if err != nil {
		refuse(rw, r, err)
		return caller{}, nil, false
	}
	return who, release, true
}

// envdRoutes is envd inside a sandbox: the Connect services and the
// REST endpoints the SDKs call.
func (s *Server) envdRoutes() *http.ServeMux {
	m := http.NewServeMux()
	m.Handle(processconnect.NewProcessHandler(processService{s}, connect.WithReadMaxBytes(maxMessage)))
	m.Handle(filesystemconnect.NewFilesystemHandler(filesystemService{s}, connect.WithReadMaxBytes(maxMessage)))
	m.HandleFunc("GET /health", s.health)
	m.HandleFunc("GET /files", s.readFile)
	m.HandleFunc("POST /files", s.writeFiles)
	m.HandleFunc("GET /envs", s.envs)
	m.HandleFunc("/", func(rw http.ResponseWriter, r *http.Request) {
		writeError(rw, fmt.Errorf("envd %s %s: not served by dsec's E2B front: %w", r.Method, r.URL.Path, errdefs.ErrNotFound))
	})
	return m
}

// restClient is envdClient for the REST endpoints, whose errors are
// E2B's JSON ones.
func (s *Server) restClient(rw http.ResponseWriter, r *http.Request) (*sdk.Client, string, bool) {
	c, id, err := s.envdClient(r.Context(), r.Header)
	if err == nil {
		err = rootOnly(r.URL.Query().Get("username"))
	}
	if err != nil {
		writeError(rw, err)
		return nil, "", false
	}
	return c, id, true
}

// health is 204 while the sandbox runs (the SDK's isRunning), 502
// otherwise.
func (s *Server) health(rw http.ResponseWriter, r *http.Request) {
	c := s.as(callerOf(r.Context()))
	if sb, err := inspect(r.Context(), c, sandboxOf(r.Context())); err == nil && sb.Status == api.StatusRunning {
		rw.WriteHeader(http.StatusNoContent)
		return
	}
	writeJSON(rw, http.StatusBadGateway, errorBody{Code: http.StatusBadGateway, Message: "sandbox is not running"})
}

func (s *Server) envs(rw http.ResponseWriter, r *http.Request) {
	_, id, ok := s.restClient(rw, r)
	if !ok {
		return
	}
	rec, _ := s.records.get(id)
	env := rec.EnvVars
	if env == nil {
		env = map[string]string{}
	}
	writeJSON(rw, http.StatusOK, env)
}

// absPath is a path of the SDKs' in the sandbox: relative ones are the
// home's of the user (root's).
func absPath(p string) (string, error) {
	if p == "" {
		return "", fmt.Errorf("no path: %w", errdefs.ErrInvalidArgument)
	}
	return path.Clean(homeRelative(p)), nil
}

func (s *Server) readFile(rw http.ResponseWriter, r *http.Request) {
	c, id, ok := s.restClient(rw, r)
	if !ok {
		return
	}
	p, err := absPath(r.URL.Query().Get("path"))
	if err != nil {
		writeError(rw, err)
		return
	}
	sb := c.Sandbox(id)
	// The worker refuses what is not a regular file (a directory: 400)
	// before it sends a byte: that is E2B's JSON error then.
	rw.Header().Set("Content-Type", "application/octet-stream")
	rw.Header().Set("Content-Disposition", mime.FormatMediaType("inline", map[string]string{"filename": path.Base(p)}))
	hw := &headerWriter{rw: rw}
	if err := sb.ReadFile(r.Context(), p, hw); err != nil && !hw.wrote {
		writeError(rw, err)
		return
	}
	if !hw.wrote {
		rw.Header().Set("Content-Length", "0")
		rw.WriteHeader(http.StatusOK)
	}
}

// headerWriter sends the answer's header with the first bytes, so that
// an error before any is E2B's JSON error.
type headerWriter struct {
	rw    http.ResponseWriter
	wrote bool
}

func (h *headerWriter) Write(b []byte) (int, error) {
	if !h.wrote {
		h.wrote = true
		h.rw.WriteHeader(http.StatusOK)
	}
	return h.rw.Write(b)
}

// entryAnswer is what an upload answers per file written.
type entryAnswer struct {
	Name string `json:"name"`
	Type string `json:"type"`
	Path string `json:"path"`
}

// writeFiles writes the files of an upload: multipart parts named file
// (each to the path query, or its filename), or an octet-stream body to
// the path query. Parent directories are made; each file is written
// whole or not at all (dsec writes a temporary file and renames it).
func (s *Server) writeFiles(rw http.ResponseWriter, r *http.Request) {
	c, id, ok := s.restClient(rw, r)
	if !ok {
		return
	}
	sb := c.Sandbox(id)
	q := r.URL.Query().Get("path")
	var out []entryAnswer
	write := func(dest string, body io.Reader) error {
		p, err := absPath(dest)
		if err != nil {
			return err
		}
		if dir := path.Dir(p); dir != "/" {
			if _, err := sb.MakeDir(r.Context(), dir, true); err != nil && !errdefs.IsAlreadyExists(err) {
				return err
			}
		}
		lr := &limitReader{r: body}
		lr.left.Store(maxUpload + 1)
		err = sb.WriteFile(r.Context(), p, lr, 0o644)
		if lr.left.Load() <= 0 {
			return fmt.Errorf("%s: a file over %d bytes: write it in parts: %w", p, int64(maxUpload), errdefs.ErrOutOfRange)
		}
		if err != nil {
			return err
		}
		out = append(out, entryAnswer{Name: path.Base(p), Type: "file", Path: p})
		return nil
	}
	mt, params, _ := mime.ParseMediaType(r.Header.Get("Content-Type"))
	var err error
	switch {
	case mt == "multipart/form-data":
		mr := multipart.NewReader(r.Body, params["boundary"])
		for {
			part, perr := mr.NextPart()
			if perr == io.EOF {
				break
			}
			if perr != nil {
				err = fmt.Errorf("bad multipart upload: %v: %w", perr, errdefs.ErrInvalidArgument)
				break
			}
			if part.FormName() != "file" {
				continue
			}
			dest := q
			if dest == "" { // the whole path: Part.FileName keeps only its base
				_, cd, _ := mime.ParseMediaType(part.Header.Get("Content-Disposition"))
				dest = cd["filename"]
			}
			if err = write(dest, part); err != nil {
				break
			}
		}
	default:
		body := io.Reader(r.Body)
		if r.Header.Get("Content-Encoding") == "gzip" {
			err = fmt.Errorf("gzip uploads are not served: send the bytes as they are: %w", errdefs.ErrInvalidArgument)
			break
		}
		err = write(q, body)
	}
	if err == nil && len(out) == 0 {
		err = fmt.Errorf("the upload holds no file (a multipart part named file): %w", errdefs.ErrInvalidArgument)
	}
	if errdefs.IsOutOfRange(err) { // the SDKs' NotEnoughSpaceError
		writeJSON(rw, http.StatusInsufficientStorage, errorBody{Code: http.StatusInsufficientStorage, Message: err.Error()})
		return
	}
	if err != nil {
		writeError(rw, err)
		return
	}
	writeJSON(rw, http.StatusOK, out)
}

// filesystemService implements envd's Filesystem service.
type filesystemService struct{ s *Server }

func (f filesystemService) sandbox(ctx context.Context, h http.Header) (*sdk.Sandbox, error) {
	c, id, err := f.s.envdClient(ctx, h)
	if err == nil {
		err = rootOnly(userOf(h))
	}
	if err != nil {
		return nil, connErr(err)
	}
	return c.Sandbox(id), nil
}

// at is the sandbox of a request and the path p it names there.
func (f filesystemService) at(ctx context.Context, h http.Header, p string) (*sdk.Sandbox, string, error) {
	sb, err := f.sandbox(ctx, h)
	if err != nil {
		return nil, "", err
	}
	abs, err := absPath(p)
	if err != nil {
		return nil, "", connErr(err)
	}
	return sb, abs, nil
}

// entryOf is a dsec path's stat as envd's EntryInfo.
func entryOf(p string, st api.PathStat) *fspb.EntryInfo {
	e := &fspb.EntryInfo{Name: st.Name, Path: p, Size: st.Size, Mode: uint32(st.Mode.Perm()), Permissions: st.Mode.String(),
		ModifiedTime: timestamppb.New(st.Mtime)}
	switch {
	case st.Mode.IsDir():
		e.Type = fspb.FileType_FILE_TYPE_DIRECTORY
	case st.Mode&fs.ModeSymlink != 0:
		e.Type = fspb.FileType_FILE_TYPE_SYMLINK
		e.SymlinkTarget = &st.LinkTarget
	case st.Mode.IsRegular():
		e.Type = fspb.FileType_FILE_TYPE_FILE
	}
	return e
}

func (f filesystemService) Stat(ctx context.Context, req *connect.Request[fspb.StatRequest]) (*connect.Response[fspb.StatResponse], error) {
	sb, p, err := f.at(ctx, req.Header(), req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	st, err := sb.Stat(ctx, p, false)
	if err != nil {
		return nil, connErr(err)
	}
	return connect.NewResponse(&fspb.StatResponse{Entry: entryOf(p, st)}), nil
}

func (f filesystemService) ListDir(ctx context.Context, req *connect.Request[fspb.ListDirRequest]) (*connect.Response[fspb.ListDirResponse], error) {
	sb, p, err := f.at(ctx, req.Header(), req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	ents, err := sb.ListDir(ctx, p, int(max(req.Msg.GetDepth(), 1)))
	if err != nil {
		return nil, connErr(err)
	}
	out := &fspb.ListDirResponse{}
	for _, e := range ents {
		out.Entries = append(out.Entries, entryOf(e.Path, e.PathStat))
	}
	return connect.NewResponse(out), nil
}

func (f filesystemService) MakeDir(ctx context.Context, req *connect.Request[fspb.MakeDirRequest]) (*connect.Response[fspb.MakeDirResponse], error) {
	sb, p, err := f.at(ctx, req.Header(), req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	st, err := sb.MakeDir(ctx, p, true)
	if err != nil {
		return nil, connErr(err)
	}
	return connect.NewResponse(&fspb.MakeDirResponse{Entry: entryOf(p, st)}), nil
}

func (f filesystemService) Move(ctx context.Context, req *connect.Request[fspb.MoveRequest]) (*connect.Response[fspb.MoveResponse], error) {
	sb, from, err := f.at(ctx, req.Header(), req.Msg.GetSource())
	if err != nil {
		return nil, err
	}
	to, err := absPath(req.Msg.GetDestination())
	if err != nil {
		return nil, connErr(err)
	}
	st, err := sb.Rename(ctx, from, to)
	if err != nil {
		return nil, connErr(err)
	}
	return connect.NewResponse(&fspb.MoveResponse{Entry: entryOf(to, st)}), nil
}

func (f filesystemService) Remove(ctx context.Context, req *connect.Request[fspb.RemoveRequest]) (*connect.Response[fspb.RemoveResponse], error) {
	sb, p, err := f.at(ctx, req.Header(), req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	if err := sb.RemovePath(ctx, p, true); err != nil {
		return nil, connErr(err)
	}
	return connect.NewResponse(&fspb.RemoveResponse{}), nil
}

var errNoWatch = errors.New("watching directories is not served by dsec's E2B front yet")

func (f filesystemService) WatchDir(context.Context, *connect.Request[fspb.WatchDirRequest], *connect.ServerStream[fspb.WatchDirResponse]) error {
	return connect.NewError(connect.CodeUnimplemented, errNoWatch)
}

func (f filesystemService) CreateWatcher(context.Context, *connect.Request[fspb.CreateWatcherRequest]) (*connect.Response[fspb.CreateWatcherResponse], error) {
	return nil, connect.NewError(connect.CodeUnimplemented, errNoWatch)
}

func (f filesystemService) GetWatcherEvents(context.Context, *connect.Request[fspb.GetWatcherEventsRequest]) (*connect.Response[fspb.GetWatcherEventsResponse], error) {
	return nil, connect.NewError(connect.CodeUnimplemented, errNoWatch)
}

func (f filesystemService) RemoveWatcher(context.Context, *connect.Request[fspb.RemoveWatcherRequest]) (*connect.Response[fspb.RemoveWatcherResponse], error) {
	return nil, connect.NewError(connect.CodeUnimplemented, errNoWatch)
}

// proxy sends a request for another port of a sandbox to it, through
// the API's port route (a sandbox in network mode nat has an address
// there), so that a sandbox on another host of a gateway's is reached
// too; the caller's key must see the sandbox (X-Access-Token, or the
// E2B traffic token header).
func (s *Server) proxy(rw http.ResponseWriter, r *http.Request, id string, port int) {
	token := r.Header.Get("X-Access-Token")
	if token == "" {
		token = r.Header.Get("E2b-Traffic-Access-Token")
	}
	who, release, ok := s.admit(rw, r, id, token)
	if !ok {
		return
	}
	defer release()
	p := &httputil.ReverseProxy{Transport: actAs{s.opts.Transport, cmp.Or(who.id, ActAsAdmin), who.token}, FlushInterval: -1,
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.Out.URL = &url.URL{Scheme: "http", Host: "dsec-worker",
				Path:     "/" + api.Version + "/sandboxes/" + url.PathEscape(id) + "/ports/" + strconv.Itoa(port) + pr.In.URL.Path,
				RawQuery: pr.In.URL.RawQuery}
			pr.Out.Host = "dsec-worker"
			pr.Out.Header.Set("X-Forwarded-Host", pr.In.Host)
			for _, h := range []string{"X-Access-Token", "E2b-Traffic-Access-Token", "X-Api-Key", "E2b-Sandbox-Id", "E2b-Sandbox-Port",
				HeaderActAs, HeaderActAsToken, HeaderTemplate, HeaderRecord, HeaderDomain, HeaderUser} {
				pr.Out.Header.Del(h) // the sandbox sees none of the caller's secrets
			}
		},
		ErrorHandler: func(rw http.ResponseWriter, _ *http.Request, err error) {
			writeError(rw, fmt.Errorf("sandbox %s port %d: %v: %w", id, port, err, errdefs.ErrUnavailable))
		}}
	p.ServeHTTP(rw, r)
}

// limitReader is io.LimitedReader whose bound may be read while another
// goroutine reads it: a worker that answered early (a disk full) has
// its transport still reading the upload after WriteFile returned.
type limitReader struct {
	r    io.Reader
	left atomic.Int64
}

func (l *limitReader) Read(p []byte) (int, error) {
	left := l.left.Load()
	if left <= 0 {
		return 0, io.EOF
	}
	if int64(len(p)) > left {
		p = p[:left]
	}
	n, err := l.r.Read(p)
	l.left.Add(-int64(n))
	return n, err
}
