import json, sys, collections
recs=[json.loads(l) for l in open(sys.argv[1])]
def role(cmd):
    c=cmd.split()[0] if cmd else '?'
    if c.startswith('ray::'):
        c=c.split('.')[0]
        return c[:55]
    for k in ('haproxy','raylet','gcs_server','dashboard','bin/dspark','sampler','log_monitor','runtime_env','process_api','monitor.py'):
        if k in cmd: return k
    return 'other:'+cmd[:30]
prev=None; groups=collections.defaultdict(list)
for r in recs:
    cur={(pid,tid):(role(cmd),t) for pid,cmd,ths in r['procs'] for tid,comm,t in ths}
    pidrole={pid:role(cmd) for pid,cmd,ths in r['procs']}
    if prev:
        dt=r['t']-prev[0]; d=collections.Counter()
        for k in cur:
            if k in prev[1]: d[pidrole[k[0]]]+=(cur[k][1]-prev[1][k][1])/dt
        tot=sum(d.values())
        if tot>1.8:
            top=d.most_common(1)[0][0]
            groups[top].append(d)
    prev=(r['t'],cur)
names=sorted({k for ds in groups.values() for d in ds for k in d})
labs=list(groups)
print(f'{"process":56s}'+''.join(f'{l[-22:]:>24s}' for l in labs))
rows=[]
for k in names:
    vals=[sum(d.get(k,0) for d in groups[l])/len(groups[l]) for l in labs]
    rows.append((max(vals),k,vals))
for m,k,vals in sorted(rows,reverse=True)[:20]:
    print(f'{k:56s}'+''.join(f'{v:24.3f}' for v in vals))
print('windows', [len(groups[l]) for l in labs])
