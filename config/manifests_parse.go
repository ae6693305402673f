package config

// Parsing one manifest file: YAML or JSON documents, each a Kubernetes
// object or a v1 List of them, decoded strictly.

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	goruntime "runtime"
	"strings"
	"sync"
	"sync/atomic"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/runtime"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	kjson "sigs.k8s.io/json"
	"sigs.k8s.io/yaml"
)

// parseFile splits a file into documents and converts them in parallel (a
// 10k-Service file is mostly YAML parsing), then joins the results in
// document order, so the first bad document is the one reported.
func parseFile(file string, data []byte) (*fileResult, error) {
	var docs [][]byte
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	for {
		raw, err := r.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, where{file: file, doc: len(docs) + 1}.err(err)
		}
		if len(bytes.TrimSpace(stripComments(raw))) == 0 {
			continue // comment-only or empty documents are not counted
		}
		docs = append(docs, raw)
	}
	parts := make([]fileResult, len(docs))
	errs := make([]error, len(docs))
	workers := min(goruntime.GOMAXPROCS(0), max(1, len(docs)/64))
	var next atomic.Int64
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := int(next.Add(1) - 1); i < len(docs); i = int(next.Add(1) - 1) {
				at := where{file: file, doc: i + 1}
				js, err := yaml.YAMLToJSON(docs[i])
				if err != nil {
					errs[i] = at.err(err)
					continue
				}
				errs[i] = parts[i].parseObject(js, at)
			}
		}()
	}
	wg.Wait()
	fr := &fileResult{}
	for i := range parts {
		if errs[i] != nil {
			return nil, errs[i]
		}
		fr.services = append(fr.services, parts[i].services...)
		fr.slices = append(fr.slices, parts[i].slices...)
		fr.nodes = append(fr.nodes, parts[i].nodes...)
		fr.skipped = append(fr.skipped, parts[i].skipped...)
	}
	return fr, nil
}

func stripComments(doc []byte) []byte {
	var out [][]byte
	for _, line := range bytes.Split(doc, []byte("\n")) {
		if t := bytes.TrimSpace(line); len(t) > 0 && t[0] != '#' {
			out = append(out, line)
		}
	}
	return bytes.Join(out, []byte("\n"))
}

type typeMeta struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
	Metadata   struct {
		Name      string `json:"name"`
		Namespace string `json:"namespace"`
	} `json:"metadata"`
}

func (fr *fileResult) parseObject(js []byte, at where) error {
	if bytes.Equal(bytes.TrimSpace(js), []byte("null")) {
		return nil
	}
	var tm typeMeta
	if err := json.Unmarshal(js, &tm); err != nil {
		return at.err(fmt.Errorf("not a Kubernetes object: %w", err))
	}
	if tm.Kind == "" || tm.APIVersion == "" {
		return at.err(errors.New("apiVersion and kind are required"))
	}
	ns := tm.Metadata.Namespace
	if ns == "" {
		ns = "default"
	}
	at.object = fmt.Sprintf("%s %s/%s", tm.Kind, ns, tm.Metadata.Name)
	switch {
	case tm.APIVersion == "v1" && strings.HasSuffix(tm.Kind, "List"):
		return fr.parseList(js, tm.Kind, at)
	case tm.APIVersion == "v1" && tm.Kind == "Service":
		return fr.parseService(js, at)
	case tm.APIVersion == "discovery.k8s.io/v1" && tm.Kind == "EndpointSlice":
		return fr.parseSlice(js, at)
	case tm.APIVersion == "v1" && tm.Kind == "Node":
		var n v1.Node
		if err := strictInto(js, at, &n); err != nil {
			return err
		}
		zone, deleting := NodeState(&n)
		cidrs, err := NodePodCIDRs(&n)
		if err != nil {
			return at.err(err)
		}
		fr.nodes = append(fr.nodes, parsedNode{name: n.Name, zone: zone, deleting: deleting, podCIDRs: cidrs})
		return nil
	case tm.APIVersion == "v1" && tm.Kind == "Endpoints":
		return fr.parseEndpoints(js, at)
	}
	fr.skipped = append(fr.skipped, Skipped{Object: at.object, Reason: "kind " + tm.APIVersion + " " + tm.Kind + " is not used by the proxy"})
	return nil
}

// strictInto decodes js into into, refusing unknown and duplicate fields.
func strictInto(js []byte, at where, into any) error {
	strictErrs, err := kjson.UnmarshalStrict(js, into)
	if err != nil {
		return at.err(cleanJSONError(err))
	}
	if len(strictErrs) > 0 {
		return at.err(cleanJSONError(strictErrs[0]))
	}
	return nil
}

func (fr *fileResult) parseList(js []byte, kind string, at where) error {
	var list struct {
		Items []runtime.RawExtension `json:"items"`
	}
	if err := json.Unmarshal(js, &list); err != nil {
		return at.err(fmt.Errorf("%s: %w", kind, err))
	}
	for i, item := range list.Items {
		if err := fr.parseObject(item.Raw, where{file: at.file, doc: at.doc, item: fmt.Sprintf("items[%d]", i)}); err != nil {
			return err
		}
	}
	return nil
}

func (fr *fileResult) parseService(js []byte, at where) error {
	var svc v1.Service
	if err := strictInto(js, at, &svc); err != nil {
		return err
	}
	defaultNamespace(&svc.Namespace)
	key, sps, skip, err := convertService(&svc)
	switch {
	case err != nil:
		return at.err(err)
	case skip != "":
		fr.skipped = append(fr.skipped, Skipped{Object: at.object, Reason: skip})
	default:
		fr.services = append(fr.services, parsedService{at: at, key: key, ports: sps})
		if un := UnservedPorts(&svc); len(un) > 0 {
			fr.skipped = append(fr.skipped, Skipped{Object: at.object, Reason: UnservedMessage(un), Warning: true})
		}
	}
	return nil
}

func (fr *fileResult) parseSlice(js []byte, at where) error {
	var es discovery.EndpointSlice
	if err := strictInto(js, at, &es); err != nil {
		return err
	}
	defaultNamespace(&es.Namespace)
	key, eps, skip, err := convertSlice(&es)
	switch {
	case err != nil:
		return at.err(err)
	case skip != "":
		fr.skipped = append(fr.skipped, Skipped{Object: at.object, Reason: skip})
	default:
		fr.slices = append(fr.slices, parsedSlice{at: at, key: key, eps: eps})
	}
	return nil
}

// parseEndpoints takes a v1 Endpoints as the slices the endpointslice
// mirroring controller would make of it.
func (fr *fileResult) parseEndpoints(js []byte, at where) error {
	var eps v1.Endpoints
	if err := strictInto(js, at, &eps); err != nil {
		return err
	}
	defaultNamespace(&eps.Namespace)
	slices, err := EndpointsToSlices(&eps)
	if err != nil {
		return at.err(err)
	}
	for _, es := range slices {
		m, err := SliceEndpoints(es)
		if err != nil {
			return at.err(err)
		}
		fr.slices = append(fr.slices, parsedSlice{at: at, key: ServiceName{eps.Namespace, eps.Name}, eps: m, legacy: true})
	}
	return nil
}

func defaultNamespace(ns *string) {
	if *ns == "" {
		*ns = "default"
	}
}

// cleanJSONError drops the decoder's "error unmarshaling JSON: while decoding
// JSON:" prefixes, which say nothing to someone editing YAML.
func cleanJSONError(err error) error {
	msg := err.Error()
	for _, p := range []string{"error unmarshaling JSON: ", "while decoding JSON: ", "json: "} {
		msg = strings.TrimPrefix(msg, p)
	}
	if msg == err.Error() {
		return err
	}
	return errors.New(msg)
}
